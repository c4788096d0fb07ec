"""Loss-mask conventions: which positions a record trains, for SpecForge's one-token shift.

SpecForge 0.2.0 (and EAGLE-3's reference trainer) train position ``t`` of a record on the
drafter input ``(aux_hidden_state[t], input_ids[t+1])`` towards ``lm_head(hidden_state[t+1])``,
the target's distribution of token ``t+2``, weighted by ``loss_mask[t]`` unshifted
(``specforge/modeling/target/target_head.py`` ``TargetHead.preprocess``: ``padding(target,
left=False)``, ``padding(input_ids, left=False)``, ``loss_mask`` as is). At serving time
(SGLang EAGLE-3), after the prefill of a turn's prompt ``x[0:p]`` the target emits ``x[p]``;
the drafter then runs at ``t = p-1`` (state of the last prompt token, token ``x[p]``) and
proposes ``x[p+1]``, and so on up to the end of turn ``x[e]``. So the positions whose training
target is a token the drafter proposes in that turn are ``t = p-1 .. e-2``.

* ``completion`` (default): 1 on the turn's emitted tokens ``x[p..e]``, as SpecForge's own data
  preparation marks assistant spans. Under the shift it leaves ``t = p-1`` (the first drafted
  position) untrained and trains ``t = e-1, e`` (inputs at and after the end of turn).
* ``drafted``: 1 exactly on ``t = p-1 .. e-2``: ``loss_mask[t] = c[t+1] and c[t+2]`` for the
  completion mask ``c``, i.e. the drafter's input token and its target token both emitted in
  the same turn.
"""

from __future__ import annotations

LOSS_MASKS = ("completion", "drafted")


def drafted_mask(completion: list[int]) -> list[int]:
    """The ``drafted`` mask of a completion mask (see the module docstring)."""
    n = len(completion)
    return [int(t + 2 < n and completion[t + 1] == 1 and completion[t + 2] == 1)
            for t in range(n)]


def apply_convention(completion: list[int], convention: str) -> list[int]:
    """The loss mask to store for ``convention`` (one of :data:`LOSS_MASKS`)."""
    if convention == "completion":
        return completion
    if convention == "drafted":
        return drafted_mask(completion)
    raise ValueError(f"unknown loss-mask convention {convention!r}; choose one of "
                     f"{', '.join(LOSS_MASKS)}")
