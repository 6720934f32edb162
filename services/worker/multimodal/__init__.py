"""The worker's side of images: which rows of a step take which image's embeddings, and
the encoder outputs kept until their placeholder spans are prefilled."""
