"""What a full sync's apply keeps of the texts it committed: at most ``keep`` characters, never the whole table's
text until its last chunk (70 MB at 100,000 x 10, once held beside everything else the sync needs)."""

from kproxy.backends.nftables.kernel import Outcome


def test_texts_are_kept_while_they_fit() -> None:
    out = Outcome()
    out.committed("add element a\n", keep=100)
    out.committed("add element b\n", keep=100)
    assert out.kept == "add element a\nadd element b\n"
    assert out.size == 28


def test_texts_over_the_limit_are_all_dropped_and_still_counted() -> None:
    out = Outcome()
    out.committed("x" * 60, keep=100)
    out.committed("y" * 60, keep=100)
    assert out.texts == [] and out.kept is None
    out.committed("z", keep=100)  # a later small chunk is not kept alone: the text would not be the batch's
    assert out.texts == [] and out.kept is None
    assert out.size == 121
