"""The path in an error message names each step as Python would write it:
dict keys with repr (quotes, escapes, non-ASCII, non-str keys), indices,
attribute names; short ASCII paths and the general route give the same text."""
import collections

import numpy as np
import pytest

import dpmini

DEVS = ["cpu:0", "cpu:1"]
KEYS = ["a", "a b", "it's", 'x"y', "both'\"", "back\\slash", "tab\there", "naïve", "日本",
        "", "~!@#$%^&*()", 5, -1, (1, "t"), 2.5, None, True]


def zero_dim_error(inputs):
    """The ValueError message of scattering a 0-dim array inside inputs."""
    with pytest.raises(ValueError, match="chunk expects at least a 1-dimensional") as err:
        dpmini.DataParallel(lambda *a: a, device_ids=DEVS)(*inputs)
    return str(err.value)


@pytest.mark.parametrize("key", KEYS, ids=repr)
def test_dict_key_is_shown_with_its_repr(key):
    msg = zero_dim_error(({"outer": [np.ones(2), {key: np.ones(())}]},))
    assert msg.startswith(f"args[0]['outer'][1][{key!r}]: "), msg


def test_attribute_and_index_steps():
    Point = collections.namedtuple("Point", ["xs", "why_not"])
    msg = zero_dim_error(([Point(np.ones(2), [np.ones(2), np.ones(())])],))
    assert msg.startswith("args[0][0].why_not[1]: "), msg


def test_long_ascii_path_and_long_key():
    deep = np.ones(())
    for i in range(20):
        deep = {f"level{i}": deep}
    expected = "args[0]" + "".join(f"['level{i}']" for i in reversed(range(20)))
    assert zero_dim_error((deep,)).startswith(expected + ": ")
    key = "k" * 600   # longer than the short-path buffer
    assert zero_dim_error(({key: np.ones(())},)).startswith(f"args[0][{key!r}]: ")
