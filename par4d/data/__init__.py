"""Training data as token ids (docs/data.md): Hugging Face tokenizers, datasets prepared once into
memory-mapped token shards and read a window at a time.

* :mod:`par4d.data.tokenizer`: a ``tokenizer.json`` (or a model folder holding one), checked and hashed.
* :mod:`par4d.data.prepare`: text files, JSON lines and Parquet tokenized into a dataset folder
  (``par4d data prepare``), restartable, never half-written where it looks complete.
* :mod:`par4d.data.dataset`: such a folder opened and checked; the batches of a step, each rank
  reading only its own rows.

Nothing here imports torch but :mod:`par4d.data.dataset`'s batches.
"""
