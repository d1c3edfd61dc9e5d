"""support.file_order: scripts/test hands whole files to its workers longest first, each file's
tests in the order pytest-randomly gave them."""

from support.file_order import ordered


def test_whole_files_go_longest_first_and_keep_their_own_order():
    ids = ["a.py::t2", "b.py::t1", "a.py::t1", "c.py::t9", "b.py::t0", "new.py::t"]
    costs = {"a.py": 5.0, "b.py": 90.0, "c.py": 1.0}  # new.py: not measured, counts as the median (5.0)
    got = [ids[i] for i in ordered(ids, costs)]
    assert got == ["b.py::t1", "b.py::t0", "a.py::t2", "a.py::t1", "new.py::t", "c.py::t9"]


def test_without_costs_the_order_is_kept():
    ids = ["z.py::a", "y.py::b", "z.py::c"]
    assert ordered(ids, {}) == [0, 1, 2]
