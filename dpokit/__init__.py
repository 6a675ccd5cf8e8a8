"""The kit's library, in layers. A layer imports only the layers before it in LAYERS (tests/test_layout.py checks
it, imports inside functions included); nothing here imports the scripts at the repository's top."""

LAYERS = ("core", "sandbox", "data", "model", "scoring", "pairs", "train", "apps", "service")
