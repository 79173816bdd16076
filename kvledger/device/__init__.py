"""The devices a model runs on."""
