"""Learning a Pre-cut Q-table (`postuse`'s controller) by decoding training prompts with learning on.

The config's drafter, cache and controller settings are used as given; only `freeze` is turned off (and `epsilon`
set when given). Training prompts only: files that look like evaluation sets are refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hf_spec.io.jsonl import read_json, read_jsonl
from hf_spec.training.prompts import check_not_eval


def read_prompts(path: str | Path) -> list[str]:
    """First user turns of a ShareGPT `.json`, an Alpaca seed-task `.jsonl` (instruction + first input) or a
    Spec-Bench `.jsonl` (`turns[0]`)."""
    path = Path(path)
    check_not_eval(path)
    if path.suffix == ".json":
        rows = read_json(path)
        out = []
        for row in rows:
            turns = [t["value"] for t in row.get("conversations", []) if t.get("from") == "human"]
            if turns and turns[0].strip():
                out.append(turns[0])
        return out
    out = []
    for line_no, row in read_jsonl(path):
        if "turns" in row:
            out.append(row["turns"][0])
        elif "instruction" in row:
            extra = (row.get("instances") or [{}])[0].get("input", "")
            out.append((row["instruction"] + "\n" + extra).strip())
        else:
            raise ValueError(f"{path}:{line_no}: neither Spec-Bench `turns` nor Alpaca `instruction`")
    return out


def learn_q_table(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    config,
    prompts: Sequence[str],
    max_new_tokens: int = 128,
    epsilon: float | None = None,
    progress: bool = True,
):
    """Decode `prompts` greedily with `config` (a `PostUseConfig` with its `precut` part set), learning as it goes
    (`precut.freeze` off, `precut.epsilon` set to `epsilon` when given); returns the `PostUseDrafter` whose
    `save_q_table(path)` writes the table and whose `stats` say how the chains fared."""
    from hf_spec.bench.prompts import encode_chat
    from hf_spec.decoder import SpeculativeDecoder

    if config.precut is None:
        raise ValueError("this postuse config has precut off: there is no Q-table to learn")
    config.precut.freeze = False
    if epsilon is not None:
        config.precut.epsilon = epsilon
    decoder = SpeculativeDecoder(config, tokenizer=tokenizer)
    drafter = decoder.drafter_for(model)
    bar = tqdm(prompts, desc="train postuse", unit="prompt", disable=not progress)
    for text in bar:
        ids = encode_chat(tokenizer, [{"role": "user", "content": text}]).to(model.device)
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                custom_generate=decoder,
            )
        st = drafter.stats
        bar.set_postfix(
            util=f"{st.chain_accepted / max(st.chain_tokens, 1):.2f}",
            len=f"{st.chain_tokens / max(st.rounds, 1):.1f}",
            c_T=f"{drafter.target_cost:.2f}",
        )
    return drafter


__all__ = ["learn_q_table", "read_prompts"]
