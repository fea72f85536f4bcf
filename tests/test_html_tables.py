"""HTML tables used by every ``_repr_html_``: values and keys are escaped, rows keep their order."""
from omnilab.html_tables import html_table, key_value_table


def test_tables_escape_and_keep_order():
    t = html_table(["a<b", "c"], [[1, "<script>"], ["x&y", 2]])
    assert "a&lt;b" in t and "&lt;script&gt;" in t and "<script>" not in t
    assert t.index("&lt;script&gt;") < t.index("x&amp;y")
    kv = key_value_table({"k<": "v>", "second": 2})
    assert "k&lt;" in kv and "v&gt;" in kv and kv.index("k&lt;") < kv.index("second")


def test_floats_are_rounded_for_reading_and_summary_renders():
    from omnilab.html_tables import Summary, fmt

    assert [fmt(12.345678), fmt(0.00123456), fmt(123456.7), fmt(3), fmt(float("nan"))] == \
        ["12.35", "0.001235", "123457", "3", "nan"]
    assert "12.345678" not in html_table(["x"], [[12.345678]])
    s = Summary(rtf=0.123456, frames=30)
    assert s == {"rtf": 0.123456, "frames": 30} and "<table>" in s._repr_html_() and "0.1235" in s._repr_html_()
