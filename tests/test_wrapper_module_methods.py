"""dpmini.DataParallel forwards torch.nn.Module's methods to its module (spec
1.8: torch's wrapper is an nn.Module with one child, "module"). Checked here
without torch, on a module-like object that records what it is asked; the
comparison with torch.nn.DataParallel itself is tests/interop/
test_torch_wrapper_module_methods.py."""
import collections

import pytest

import dpmini


class Keys(collections.namedtuple("Keys", "missing_keys unexpected_keys")):
    pass


class FakeModule:
    """Records calls; holds two 'parameters' a and b.c and a 'buffer' n."""

    def __init__(self):
        self.calls = []
        self.training = True
        self.loaded = None

    def __call__(self, x):
        return x

    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        self.calls.append(("named_parameters", prefix, recurse, remove_duplicate))
        return iter([(prefix + ".a", 1), (prefix + ".b.c", 2)])

    def parameters(self, recurse=True):
        self.calls.append(("parameters", recurse))
        return iter([1, 2])

    def named_buffers(self, prefix="", recurse=True, remove_duplicate=True):
        return iter([(prefix + ".n", 3)])

    def buffers(self, recurse=True):
        return iter([3])

    def named_modules(self, memo=None, prefix="", remove_duplicate=True):
        return iter([(prefix, self)])

    def state_dict(self, destination=None, prefix="", keep_vars=False):
        self.calls.append(("state_dict", destination, prefix, keep_vars))
        return {prefix + "a": 1, prefix + "b.c": 2}

    def load_state_dict(self, sd, strict=True):
        self.loaded = dict(sd)
        missing = [k for k in ("a", "b.c") if k not in sd]
        return Keys(missing, [k for k in sd if k not in ("a", "b.c")])

    def train(self, mode=True):
        self.training = mode
        return self

    def zero_grad(self, set_to_none=True):
        self.calls.append(("zero_grad", set_to_none))

    def to(self, *args, **kwargs):
        self.calls.append(("to", args, kwargs))
        return self


def _wrapped():
    m = FakeModule()
    return m, dpmini.DataParallel(m, ["cpu:0", "cpu:1"])


def test_names_get_the_module_level_and_recurse_false_is_empty():
    m, dp = _wrapped()
    assert list(dp.named_parameters()) == [("module.a", 1), ("module.b.c", 2)]
    assert list(dp.named_parameters(prefix="top")) == [("top.module.a", 1), ("top.module.b.c", 2)]
    assert list(dp.named_parameters(recurse=False)) == []
    assert list(dp.parameters()) == [1, 2] and list(dp.parameters(recurse=False)) == []
    assert list(dp.named_buffers()) == [("module.n", 3)] and list(dp.buffers()) == [3]
    assert m.calls[0] == ("named_parameters", "module", True, True)
    assert list(dp.named_modules()) == [("", dp), ("module", m)]
    assert list(dp.modules()) == [dp, m]
    assert list(dp.children()) == [m] and list(dp.named_children()) == [("module", m)]
    assert list(dp.named_modules(memo={dp})) == []          # already seen: nothing


def test_state_dict_keys_are_prefixed_and_load_strips_the_prefix():
    m, dp = _wrapped()
    assert dp.state_dict() == {"module.a": 1, "module.b.c": 2}
    assert dp.state_dict(prefix="p.", keep_vars=True) == {"p.module.a": 1, "p.module.b.c": 2}
    assert m.calls[-1] == ("state_dict", None, "p.module.", True)
    assert tuple(dp.load_state_dict({"module.a": 5, "module.b.c": 6})) == ([], [])
    assert m.loaded == {"a": 5, "b.c": 6}
    res = dp.load_state_dict({"module.a": 5, "x": 1}, strict=False)
    assert type(res) is Keys
    assert tuple(res) == (["module.b.c"], ["x"])
    with pytest.raises(RuntimeError) as info:
        dp.load_state_dict({"a": 5, "b.c": 6})
    assert str(info.value) == (
        'Error(s) in loading state_dict for DataParallel:\n\tMissing key(s) in state_dict: '
        '"module.a", "module.b.c". \n\tUnexpected key(s) in state_dict: "a", "b.c". ')
    with pytest.raises(TypeError, match="state_dict: expected a mapping .dict-like., got list"):
        dp.load_state_dict([1, 2])


def test_train_eval_to_zero_grad_forward_and_chain():
    m, dp = _wrapped()
    assert dp.training is True                       # the wrapper's own flag, True at first
    assert dp.eval() is dp and m.training is False and dp.training is False
    assert dp.train() is dp and m.training is True and dp.training is True
    m.train(False)                                   # the module's flag alone
    assert dp.training is True
    dp.training = False                              # the wrapper's flag alone, as nn.Module
    assert m.training is False and dp.training is False
    m.training = True
    assert dp.training is False
    import copy
    import pickle
    assert copy.copy(dp).training is False
    dp2 = pickle.loads(pickle.dumps(dp))
    assert dp2.training is False
    assert dp.to("cpu", copy=True) is dp and m.calls[-1] == ("to", ("cpu",), {"copy": True})
    assert dp.zero_grad(set_to_none=False) is None and m.calls[-1] == ("zero_grad", False)


def test_a_plain_function_module_says_what_was_forwarded():
    dp = dpmini.DataParallel(lambda x: x, ["cpu:0", "cpu:1"])
    assert dp.training is True
    for call in (dp.parameters, dp.state_dict, dp.eval):
        with pytest.raises(AttributeError, match="module .a function. has no attribute"):
            call()
    with pytest.raises(AttributeError):
        dp.weight                                 # module attributes are not forwarded
    with pytest.raises(TypeError):
        _wrapped()[1].named_parameters(prefix=3)


def test_before_init_the_methods_raise_runtime_error():
    class Late(dpmini.DataParallel):
        def __init__(self):
            pass

    dp = Late()
    for call in (dp.parameters, dp.children, dp.state_dict, dp.train):
        with pytest.raises(RuntimeError, match="__init__"):
            call()
