import pytest
import torch

from hf_spec.models.fingerprint import check_fingerprint, target_fingerprint
from tests.conftest import make_tiny_model


def test_fingerprint_matches_itself_across_dtypes():
    model = make_tiny_model("llama")
    fp = target_fingerprint(model)
    check_fingerprint(fp, model, "head")
    check_fingerprint(fp, model.to(torch.bfloat16), "head")


def test_fingerprint_rejects_other_weights_and_shapes():
    model = make_tiny_model("llama", seed=0)
    other = make_tiny_model("llama", seed=1)
    with pytest.raises(ValueError, match="different llama model"):
        check_fingerprint(target_fingerprint(model), other, "the head")
    qwen = make_tiny_model("qwen2")
    with pytest.raises(ValueError, match="model_type='llama'"):
        check_fingerprint(target_fingerprint(model), qwen, "the head")
