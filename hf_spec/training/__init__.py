"""Training data and trainers for learned parts (draft heads, exit heads).

Pipeline: training prompts (`prompts`) -> the target's own greedy answers, cached and resumable (`responses`)
-> one prefill forward per conversation capturing the target's features and top-K probabilities into shards
(`features`) -> trainers.
"""
