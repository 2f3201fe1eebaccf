"""``pdserve bench kvcompress``'s fixed parts: its prompts, its drift measure, its command."""

from __future__ import annotations

from pdserve.bench import kvcompress
from pdserve.commands.cli import build_parser


def test_drift_prompts_are_fifty_distinct_stdlib_docstrings():
    texts = kvcompress.drift_texts(50)
    assert len(set(texts)) == 50 and all(500 < len(t) <= 1000 for t in texts)
    assert kvcompress.drift_texts(50) == texts  # read from sources: the same every run


def test_agreement_counts_the_tokens_before_the_first_divergence():
    assert kvcompress._agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 4
    assert kvcompress._agreement([1, 2, 9, 4], [1, 2, 3, 4]) == 2
    assert kvcompress._agreement([9], [1, 2]) == 0


def test_registered_under_pdserve_bench():
    args = build_parser().parse_args(["bench", "kvcompress", "--engine", "torch"])
    assert args.func is kvcompress.run and args.encodings == "none,bf16,fp8"
