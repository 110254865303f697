"""bench/step_counts.py's reading of cg_annotate output (valgrind itself is not needed)."""


import pytest

from bench_support import load_bench_script

# The shape cg_annotate (valgrind 3.19) prints for a cg_diff with four events.
SAMPLE = """\
--------------------------------------------------------------------------------
Ir                  ILmr            DLmr             DLmw
--------------------------------------------------------------------------------
57,711,145 (100.0%) 95,470 (100.0%) 161,188 (100.0%) 101,041 (100.0%)  PROGRAM TOTALS

--------------------------------------------------------------------------------
Ir                  ILmr           DLmr            DLmw             file:function
--------------------------------------------------------------------------------
10,481,324 (18.16%) 6,843 ( 7.17%) 30,100 (18.67%)    128 ( 0.13%)  /tmp/Python-3.11.7/Python/ceval.c:_PyEval_EvalFrameDefault
   172,468 ( 0.30%) 8,126 ( 8.51%)    141 ( 0.09%)      2 ( 0.00%)  ???:void sort_n_vec<avx2_vector<int>, 32>(int*, int)
       342 ( 0.00%)  -4,906 (-0.47%)     -7 (-0.00%)    .  ???:unicodekeys_lookup_unicode
"""


@pytest.fixture(scope="module")
def step_counts():
    return load_bench_script("step_counts.py", "step_counts_under_test")


def test_totals_and_functions_are_read_with_signs_and_dots(step_counts):
    totals, functions = step_counts.parse_annotate(SAMPLE)
    assert totals == dict(Ir=57_711_145, ILmr=95_470, DLmr=161_188, DLmw=101_041)
    assert [f["function"] for f in functions] == [
        "/tmp/Python-3.11.7/Python/ceval.c:_PyEval_EvalFrameDefault",
        "???:void sort_n_vec<avx2_vector<int>, 32>(int*, int)",
        "???:unicodekeys_lookup_unicode",
    ]
    assert functions[1] == dict(Ir=172_468, ILmr=8_126, DLmr=141, DLmw=2,
                                function="???:void sort_n_vec<avx2_vector<int>, 32>(int*, int)")
    assert functions[2]["ILmr"] == -4_906 and functions[2]["DLmr"] == -7 and functions[2]["DLmw"] == 0


def test_output_without_totals_is_an_error(step_counts):
    with pytest.raises(RuntimeError, match="no totals"):
        step_counts.parse_annotate(SAMPLE.replace("PROGRAM TOTALS", "something else"))
