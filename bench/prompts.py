"""The prompts the decode benchmarks send (``bench/decode.py``, ``bench/peers.py``): short
plain-text openings, one per concurrent request (cycled, each tagged to stay distinct)."""

PROMPTS = [
    "The history of the printing press begins",
    "Write a short poem about autumn leaves falling",
    "Explain how a refrigerator keeps food cold",
    "List three reasons why people enjoy hiking",
    "Describe the taste of a fresh strawberry",
    "What makes a good cup of coffee in the morning",
    "Summarize the plot of a detective story",
    "Give advice to someone learning to cook",
]
