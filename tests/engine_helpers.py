"""Comparisons of the embedded engine's outputs shared by its test files."""

from __future__ import annotations


def tokens_and_logprobs(outs: list[dict]) -> list[tuple[list[int], list[float]]]:
    return [(o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]) for o in outs]


def assert_same_or_tied(got: list[dict], want: list[dict], tol: float) -> None:
    """Greedy rows from two computations of the same product that may round apart (~1e-4): the same tokens with
    log-probs within tol, up to a step where the top two were tied within tol in both (there either may win;
    the rows' continuations then differ). Asks the rows for top_logprobs_num >= 2."""
    for a, b in zip(got, want):
        tops_a, tops_b = a["meta_info"]["output_top_logprobs"], b["meta_info"]["output_top_logprobs"]
        for step, (ta, tb) in enumerate(zip(a["output_ids"], b["output_ids"])):
            (la, _, _), (lb, _, _) = tops_a[step][0], tops_b[step][0]
            assert abs(la - lb) <= tol, (step, tops_a[step], tops_b[step])
            if ta != tb:
                assert {t for _, t, _ in tops_a[step][:2]} == {t for _, t, _ in tops_b[step][:2]}
                assert tops_a[step][0][0] - tops_a[step][1][0] <= tol, (step, tops_a[step])
                assert tops_b[step][0][0] - tops_b[step][1][0] <= tol, (step, tops_b[step])
                break
