"""The judge's own logic (docs/judge.md): the negative controls put in exactly their error, the
verdict rules, and the eval metrics read back from what SpecForge's own trainer logger prints."""

from __future__ import annotations

import pytest
import torch

from judge import controls, report
from judge.train import Result, eval_metrics
from tests.harness.needs import specforge_on_path

H, L = 4, 6


def _record() -> dict[str, torch.Tensor]:
    pos = torch.arange(L, dtype=torch.bfloat16)
    return {"input_ids": torch.tensor([5, 3, 0, 7, 1, 2]),
            "loss_mask": torch.tensor([0, 0, 1, 1, 1, 1]),
            "hidden_state": pos.repeat_interleave(H).view(1, L, H),
            "aux_hidden_state": (pos + 100).repeat_interleave(3 * H).view(1, L, 3 * H)}


def test_shifted_puts_each_position_one_late_and_keeps_the_tokens():
    rec, embed = _record(), torch.randn(8, H)
    out = controls.shifted(rec, embed)
    assert out["hidden_state"][0, :, 0].tolist() == [0, 0, 1, 2, 3, 4]
    assert out["aux_hidden_state"][0, :, -1].tolist() == [100, 100, 101, 102, 103, 104]
    assert torch.equal(out["input_ids"], rec["input_ids"])
    assert torch.equal(out["loss_mask"], rec["loss_mask"])


def test_layer0_replaces_every_aux_layer_by_the_embeddings_and_keeps_the_final_state():
    rec, embed = _record(), torch.randn(8, H)
    out = controls.layer0(rec, embed)
    want = embed[rec["input_ids"]].to(torch.bfloat16)
    for k in range(3):
        assert torch.equal(out["aux_hidden_state"][0, :, k * H:(k + 1) * H], want)
    assert torch.equal(out["hidden_state"], rec["hidden_state"])


def _results(**values: list[float]) -> list[Result]:
    return [Result(name, seed, v, [], 0.0) for name, vs in values.items()
            for seed, v in enumerate(vs)]


@pytest.mark.parametrize(("anchor", "shifted", "verdict_anchor", "verdict_shifted"), [
    ([0.50, 0.56], [0.20, 0.22], "PASS", "PASS"),   # within the spread 0.06; loses by 0.33
    ([0.40, 0.42], [0.48, 0.55], "FAIL", "FAIL"),   # 0.12 below > spread 0.05; not below
])
def test_verdicts_against_the_seed_spread(anchor, shifted, verdict_anchor, verdict_shifted):
    stats = report.summary(_results(hsdump=[0.52, 0.57], anchor=anchor, shifted=shifted))
    v = report.verdicts(stats)
    assert v["hsdump"] == "reference"
    assert v["anchor"].startswith(verdict_anchor) and v["shifted"].startswith(verdict_shifted)
    assert "verdict vs hsdump" in report.table(stats, v).splitlines()[0]


def test_eval_metrics_are_read_from_specforges_own_logger(capsys):
    specforge_on_path()
    from specforge.training.assembly import _logger

    _logger({"loss": torch.tensor(2.5)}, 299)
    _logger({"eval/avg_acc": 0.25, "eval/per_position_acc": [0.25, 0.5],
             "eval/simulated_acc_len": 0.375}, 300)
    m = eval_metrics(capsys.readouterr().out)
    assert m["eval/simulated_acc_len"] == 0.375 and m["eval/per_position_acc"] == [0.25, 0.5]
    with pytest.raises(RuntimeError, match="no eval metrics"):
        eval_metrics("step 1: {'loss': 2.0}\n")
