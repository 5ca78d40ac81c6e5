"""Corpora: from a user's files to token shards the trainer reads window by window.

- sources.py: the input files and folders, read as documents (text files, .jsonl, .jsonl.gz);
- tokenizer.py: the three tokenizer schemes (bytes, a BPE trained here, an existing tokenizer.json);
- shards.py: the prepared folder's format (meta.json, token shards), written and opened;
- prepare.py: `swarm data prepare`, which ties them together;
- windows.py: windows of tokens across shard edges, for training and validation batches.
"""
