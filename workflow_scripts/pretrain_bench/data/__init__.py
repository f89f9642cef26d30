"""The data stages: corpus sources and downloads (sources, download), cleaning (corpus, corpus_parts), the shared
data products and their ids (products), the tokenizer, the token shards, the training loader, and the starting model
a run adopts its tokenizer and weights from (init_from)."""
