"""The model: one forward-pass module per architecture family, and what they share."""
