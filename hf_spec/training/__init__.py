"""Training data and trainers for learned parts (draft heads, exit heads).

Pipeline: training prompts (`prompts`) -> the target's own greedy answers, cached and resumable (`responses`)
-> one prefill forward per conversation capturing the target's features and top-K probabilities into shards
(`features`) -> trainers. Fixed text: a corpus of licensed documents (`corpus`) -> the same prefill capture with
no generation (`corpus_features`); EAGLE-3 heads train on it through `eagle3`, reading it lazily (`lazy_store`).
"""
