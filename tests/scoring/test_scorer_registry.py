"""A scorer registered from outside the library is a first-class method: parameters accept it, and the tests'
parametrised method matrix picks it up with no edit of the matrix."""

from pathlib import Path

import pytest

from kvcompress import KVCacheCompressionParameters
from kvcompress.scoring.base import Scorer
from kvcompress.scoring.registry import SCORERS, register, scorer_class

pytest_plugins = ["pytester"]
TESTS = Path(__file__).resolve().parent


def test_unknown_algorithm_lists_the_registered_ones():
    with pytest.raises(ValueError, match="method must be one of 'snapkv', 'h2o', 'kvzip'"):
        scorer_class("pyramid")


def test_register_refuses_a_second_class_under_one_name_and_non_scorers():
    class Other(Scorer):
        name = "h2o"

    with pytest.raises(ValueError, match="already registered"):
        register(Other)
    with pytest.raises(TypeError, match="Scorer subclass"):
        register(object)


def test_registered_scorer_is_accepted_by_the_parameters(monkeypatch):
    class Oldest(Scorer):
        name = "oldest_first"

        def eviction_scores(self, state, keys, values, slot_valid):
            return -state.true_positions.float().unsqueeze(1).expand(-1, keys.shape[1], -1)

    monkeypatch.setitem(SCORERS, Oldest.name, Oldest)
    assert KVCacheCompressionParameters(method="oldest_first").scorer is Oldest


def test_a_scorer_registered_in_a_test_module_joins_the_method_matrix(pytester):
    pytester.makepyfile(test_plugin_scorer=f"""
import sys
sys.path[:0] = [{str(TESTS)!r}, {str(TESTS.parent)!r}]
import torch
from kvcompress.scoring.base import Scorer
from kvcompress.scoring.registry import register
from kvcompress.slots import by_head


@register
class Newest(Scorer):
    name = "newest_for_test"

    def eviction_scores(self, state, keys, values, slot_valid):
        return by_head(state.true_positions).float().expand(-1, keys.shape[1], -1)


from test_method_matrix import test_generate_with_bounded_cache  # noqa: E402,F401  (collected here)
""")
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", "-k", "newest_for_test")
    result.assert_outcomes(passed=16)  # 2 strategies x 2 rerotations x (3 shared refinements + per_head)
