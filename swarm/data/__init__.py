"""The data pipeline: documents from files (sources.py), a tokenizer (tokenizer.py), token shards
on disk (shards.py), windows drawn from them (windows.py), and `swarm data prepare` (prepare.py)."""
