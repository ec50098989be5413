"""The parts of the README-command test's harness (``tests/gpu/readme_serve.py``) that need no GPU,
run on the CPU: the requests its servers are sent, and how release points are matched to them.
Unmarked, so CI runs them; ``pytest -m gpu tests/gpu`` deselects them."""
from __future__ import annotations

from tests.gpu import readme_serve as rs
from tests.gpu.real_engines import backbone_dir


def test_the_servers_requests_are_the_demos_and_enough_for_the_stock_comparison():
    model = backbone_dir(None)
    test = rs.requests(model, ("test",))
    every = rs.requests(model, ("train", "validation", "test"))
    assert set(test["prompts"]) == set(rs.ADAPTERS.values())
    for reqs in (test, every):
        assert reqs["stop_ids"] and all(isinstance(t, int) for t in reqs["stop_ids"])
        for adapter, prompts in reqs["prompts"].items():
            assert prompts and len(prompts) == len(reqs["uids"][adapter])
            assert all(p and all(isinstance(t, int) for t in p) for p in prompts)
            assert reqs["max_tokens"][adapter] > 0
    assert sum(map(len, every["prompts"].values())) >= 320  # test_policy_off_is_stock_under_vllms_defaults
    assert len(set(every["uids"]["counter-a"])) == len(every["uids"]["counter-a"])


def test_release_points_are_matched_to_their_calls():
    """vLLM names prompt i of completion call C ``C-i-<8 characters>``; one prompt per call here."""
    records = [{"req_id": "cmpl-b-0-1a2b3c4d", "release": 7}, {"req_id": "cmpl-a-0-deadbeef", "release": None},
               {"req_id": "cmpl-c-0-00000000", "release": 3}]
    assert rs.releases(records, ["cmpl-a", "cmpl-b", "cmpl-c", "cmpl-d"]) == [None, 7, 3, None]
