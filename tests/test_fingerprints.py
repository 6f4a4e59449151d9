"""Replica fingerprints: the checksum sees one flipped bit (training side), and the coordinator's pure
rules blame the ranks outside a strict majority only after a confirming recheck, never without a
majority or on state whose replicas never agreed."""

from __future__ import annotations

import pytest

from ftd.coordinator.fingerprints import Comparison, compare, confirmed


def test_a_step_is_judged_once_every_rank_reported() -> None:
    assert compare({0: 7, 1: 7}, 3, 10) is None
    agreed = compare({0: 7, 1: 7, 2: 7}, 3, 10)
    assert agreed is not None and agreed.agreed and agreed.dissent == ()


def test_the_ranks_outside_a_strict_majority_are_the_suspects() -> None:
    verdict = compare({0: 7, 1: 9, 2: 7, 3: 7}, 4, 10)
    assert verdict is not None and not verdict.agreed and verdict.majority and verdict.dissent == (1,)
    assert "rank(s) 1 disagree with the other 3" in verdict.reason


def test_no_majority_blames_nobody() -> None:
    for values in ({0: 1, 1: 2}, {0: 1, 1: 2, 2: 3}, {0: 1, 1: 1, 2: 2, 3: 2}):
        verdict = compare(values, len(values), 5)
        assert verdict is not None and not verdict.majority and verdict.dissent == ()


def agree(step: int) -> Comparison:
    return Comparison(step, True, (), True, f"step {step}: agree")


def differ(step: int, dissent: tuple[int, ...] = (1,), majority: bool = True) -> Comparison:
    return Comparison(step, False, dissent, majority, f"step {step}: rank(s) {dissent} disagree")


def test_action_needs_a_confirming_recheck_with_the_same_suspects() -> None:
    finding, why = confirmed([agree(55), agree(60), differ(65)], 2)
    assert finding is None and "waiting for a confirming recheck" in why
    finding, why = confirmed([agree(55), agree(60), differ(65), differ(70)], 2)
    assert why == "act" and finding is not None and finding.ranks == (1,) and finding.first_bad == 61
    assert "rank(s) 1 disagree with the majority at steps 65, 70 (they agreed at step 60)" in finding.reason
    finding, why = confirmed([agree(60), differ(65, (1,)), differ(70, (2,))], 2)
    assert finding is None and "suspects changed" in why


def test_a_transient_misreport_that_agrees_again_is_nothing() -> None:
    finding, why = confirmed([agree(60), differ(65), agree(70)], 2)
    assert finding is None and why == "the replicas agree"


def test_state_that_never_agreed_is_not_replicated_and_only_alerts() -> None:
    finding, why = confirmed([differ(5, majority=False), differ(10, majority=False)], 2)
    assert finding is None and "never agreed" in why


def test_no_majority_confirmed_rolls_back_without_a_suspect() -> None:
    finding, _ = confirmed([agree(60), differ(65, (), False), differ(70, (), False)], 2)
    assert finding is not None and finding.ranks == () and finding.first_bad == 61


def test_the_checksum_sees_a_single_flipped_bit_anywhere() -> None:
    torch = pytest.importorskip("torch")
    from ftd.training import replica_fingerprint

    params = [torch.randn(300, 7), torch.randn(5, dtype=torch.bfloat16), torch.randn(2, 2, dtype=torch.float64)]
    base = replica_fingerprint(params)
    assert base == replica_fingerprint([p.clone() for p in params]), "deterministic"
    for tensor in params:
        raw = tensor.view(-1).view(torch.uint8)
        for byte in (0, raw.numel() // 2, raw.numel() - 1):
            for bit in (0, 7):
                raw[byte] ^= 1 << bit
                assert replica_fingerprint(params) != base, (tensor.dtype, byte, bit)
                raw[byte] ^= 1 << bit
    assert replica_fingerprint(params) == base
    assert replica_fingerprint(params[::-1]) != base, "the order of the parameters counts"
