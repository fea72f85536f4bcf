"""HTML tables used by every ``_repr_html_``: values and keys are escaped, rows keep their order."""
from omnilab.html_tables import html_table, key_value_table


def test_tables_escape_and_keep_order():
    t = html_table(["a<b", "c"], [[1, "<script>"], ["x&y", 2]])
    assert "a&lt;b" in t and "&lt;script&gt;" in t and "<script>" not in t
    assert t.index("&lt;script&gt;") < t.index("x&amp;y")
    kv = key_value_table({"k<": "v>", "second": 2})
    assert "k&lt;" in kv and "v&gt;" in kv and kv.index("k&lt;") < kv.index("second")
