"""What fetching needs, below the adapters and the base model alike (both fetch: adapter
sources, base models and GGUF files): where a download may connect (``source_networks``), the
Hugging Face hub's ``hf://`` addresses, token and endpoint check (``hub``), how far a long wait
has come (``progress``), and JSON files read with an error that says what to do
(``json_file``). It imports nothing of loragate but the ``http`` leaf.
"""


class SourceError(ValueError):
    """The source cannot be fetched; the message says why and what to do."""
