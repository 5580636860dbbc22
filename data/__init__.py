"""The embedded corpus, offline GPT-2 tokenizers and the loader (loader.py), prepare.py."""
