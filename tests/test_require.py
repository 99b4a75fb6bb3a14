import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nvcontainer.errors import NvcError
from nvcontainer.request.require import MAX_EXPRESSIONS, MAX_LENGTH, evaluate, parse

TESLA_A100 = ("8.0", "Tesla", "0 (GPU-aaaa)")
GEFORCE_T4 = ("7.5", "GeForce", "1 (GPU-bbbb)")


def holds(exprs, cuda="12.4", driver="550.54.14", gpus=(TESLA_A100,)) -> bool:
    try:
        evaluate(exprs, cuda, driver, list(gpus))
    except NvcError as exc:
        assert exc.category == "requirement"
        assert "unsatisfied condition" in exc.detail, exc.detail
        return False
    return True


@pytest.mark.parametrize("expr, expected", [
    # every operator on cuda (host 12.4)
    ("cuda=12.4", True), ("cuda=12.3", False),
    ("cuda!=12.4", False), ("cuda!=12.3", True),
    ("cuda<12.5", True), ("cuda<12.4", False),
    ("cuda<=12.4", True), ("cuda<=12.3", False),
    ("cuda>12.3", True), ("cuda>12.4", False),
    ("cuda>=12.4", True), ("cuda>=12.5", False),
    # numeric, component-wise; missing trailing components are 0
    ("cuda=12.4.0", True), ("cuda=12.4.0.0", True), ("cuda>=12.4.1", False),
    ("cuda>=9", True), ("cuda<13", True), ("cuda>12", True), ("cuda=12", False),
    ("cuda>=12.10", False),                     # 10 > 4 numerically, not as text
    ("cuda>=012.04", True),
    # driver (host 550.54.14)
    ("driver>=550", True), ("driver=550.54.14", True), ("driver>550.54.13", True),
    ("driver<550.54.14.1", True), ("driver>=550.100", False),
    # names are case-insensitive
    ("CUDA>=12.4", True), ("Driver<600", True), ("ARCH>=8", True),
    # arch of the GPU (8.0)
    ("arch=8.0", True), ("arch=8", True), ("arch>=8.6", False), ("arch<9.0", True),
    # brand: = and != only, case-insensitive
    ("brand=tesla", True), ("brand=TESLA", True), ("brand!=Tesla", False), ("brand=geforce", False),
    ("brand!=geforce", True),
    # AND (comma) and OR (space)
    ("cuda>=12.0,driver>=550", True), ("cuda>=12.0,driver>=560", False),
    ("cuda>=13.0 driver>=550", True), ("cuda>=13.0 driver>=560", False),
    ("cuda>=13.0 brand=tesla,driver>=550,driver<551", True),
    ("cuda>=13.0 brand=tesla,driver>=470,driver<471 brand=unknown,driver>=550,driver<551", False),
    ("  cuda>=12.4  ", True), ("cuda>=12.4,,", True),   # empty alternatives and terms are skipped
])
def test_truth_table(expr, expected):
    assert holds([expr]) is expected


def test_multiple_expressions_are_anded():
    assert holds(["cuda>=12.0", "driver>=550"])
    assert not holds(["cuda>=12.0", "driver>=551"])
    assert not holds(["driver>=551", "cuda>=12.0"])


def test_every_selected_gpu_must_satisfy():
    assert holds(["arch>=7.5"], gpus=[TESLA_A100, GEFORCE_T4])
    assert not holds(["arch>=8.0"], gpus=[TESLA_A100, GEFORCE_T4])
    assert not holds(["brand=tesla"], gpus=[TESLA_A100, GEFORCE_T4])
    assert holds(["brand=tesla brand=geforce"], gpus=[TESLA_A100, GEFORCE_T4])


def test_without_gpus_arch_and_brand_pass_but_versions_are_checked():
    assert holds(["arch>=99.0", "brand=quadro"], gpus=[])
    assert not holds(["arch>=99.0,cuda>=13"], gpus=[])


def test_failure_message_cuda_hint_and_details():
    with pytest.raises(NvcError) as info:
        evaluate(["cuda>=12.6 brand=tesla,driver>=470,driver<471"], "12.2", "535.104.05", [GEFORCE_T4])
    assert str(info.value) == (
        "requirement error: unsatisfied condition: cuda>=12.6, please update your driver to a newer "
        "version, or use an earlier cuda container (failed term: cuda>=12.6; host CUDA 12.2, "
        "driver 535.104.05; GPU 1 (GPU-bbbb), arch 7.5, brand GeForce; the 1 other alternative failed too)"
    )


def test_failure_message_names_the_failing_term_of_the_first_alternative():
    with pytest.raises(NvcError) as info:
        evaluate(["driver>=500,arch>=9.0"], "12.4", "550.54.14", [TESLA_A100])
    assert str(info.value) == (
        "requirement error: unsatisfied condition: driver>=500,arch>=9.0 (failed term: arch>=9.0; "
        "host CUDA 12.4, driver 550.54.14; GPU 0 (GPU-aaaa), arch 8.0, brand Tesla)"
    )


def test_failure_message_without_gpu_and_with_other_alternatives():
    with pytest.raises(NvcError) as info:
        evaluate(["driver>=600 cuda>=13 cuda>=14"], "12.4", "550.54.14", [])
    assert str(info.value) == (
        "requirement error: unsatisfied condition: driver>=600 (failed term: driver>=600; "
        "host CUDA 12.4, driver 550.54.14; the 2 other alternatives failed too)"
    )


def test_failure_is_reported_for_the_gpu_that_fails():
    with pytest.raises(NvcError) as info:
        evaluate(["arch>=8.0"], "12.4", "550", [TESLA_A100, GEFORCE_T4])
    assert "GPU 1 (GPU-bbbb)" in info.value.detail and "GPU 0" not in info.value.detail


@pytest.mark.parametrize("expr, why", [
    ("cuda", "expected <name><op><value>"),
    ("cuda>>12", "a version is digits"),
    ("cuda=>12", "a version is digits"),
    ("cuda==12", "a version is digits"),
    ("cuda~12", "expected <name><op><value>"),
    ("gpu>=1", "the name must be cuda, driver, arch or brand"),
    ("cuda>=12.4a", "a version is digits"),
    ("cuda>=12..4", "a version is digits"),
    ("cuda>=.4", "a version is digits"),
    ("cuda>=12.", "a version is digits"),
    ("cuda>=", "a version is digits"),
    ("cuda>=-1", "a version is digits"),
    ("cuda>=1e3", "a version is digits"),
    ("brand>=tesla", "brand takes only = or !="),
    ("brand=", "a brand is"),
    ("brand=tes la", "expected <name><op><value>"),
    ("cuda>=12\t", "a version is digits"),
    ("=12", "expected <name><op><value>"),
])
def test_invalid_expressions(expr, why):
    with pytest.raises(NvcError) as info:
        parse(expr)
    assert info.value.category == "requirement"
    assert info.value.detail.startswith("invalid expression: ")
    assert why in info.value.detail


def test_invalid_expression_exact_text():
    with pytest.raises(NvcError) as info:
        parse("cuda>=12.4 foo=1")
    assert str(info.value) == ("requirement error: invalid expression: cuda>=12.4 foo=1 "
                               "(term 'foo=1': the name must be cuda, driver, arch or brand)")


def test_empty_expression_is_invalid():
    for expr in ("", "   ", ",,"):
        with pytest.raises(NvcError, match="no condition"):
            parse(expr)


def test_invalid_expression_reported_before_an_earlier_failure():
    with pytest.raises(NvcError, match="invalid expression"):
        evaluate(["cuda>=99", "cuda>x"], "12.4", "550", [])


def test_bounds():
    parse("cuda>=1," * ((MAX_LENGTH - 1) // 8))
    with pytest.raises(NvcError, match="longer than"):
        parse("cuda>=1," * (MAX_LENGTH // 8 + 1))
    evaluate(["cuda>=1"] * MAX_EXPRESSIONS, "12.4", "550", [])
    with pytest.raises(NvcError, match="too many requirements: 33"):
        evaluate(["cuda>=1"] * (MAX_EXPRESSIONS + 1), "12.4", "550", [])


def test_unparsable_host_version_is_a_clean_error():
    with pytest.raises(NvcError, match="the driver version is 'N/A'"):
        evaluate(["driver>=1"], "12.4", "N/A", [])


def test_parse_structure():
    e = parse("CUDA>=12.4 brand=Tesla,driver>=470")
    assert [[(t.name, t.op, t.value) for t in alt] for alt in e.alternatives] == [
        [("cuda", ">=", "12.4")], [("brand", "=", "Tesla"), ("driver", ">=", "470")]]


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=80))
def test_parser_raises_only_nvc_error(text):
    try:
        parse(text)
    except NvcError:
        pass


term = st.builds(lambda n, o, v: f"{n}{o}{v}", st.sampled_from(["cuda", "driver", "arch", "brand", "x"]),
                 st.sampled_from(["=", "!=", "<", "<=", ">", ">=", "=="]),
                 st.sampled_from(["12.4", "8", "tesla", "", "1.2.3", "a.b"]))
expr_text = st.lists(st.lists(term, max_size=3).map(",".join), max_size=3).map(" ".join)


@settings(max_examples=300, deadline=None)
@given(st.lists(expr_text, max_size=3), st.sampled_from(["12.4", "x"]),
       st.lists(st.tuples(st.sampled_from(["8.0", "7.5", "?"]), st.sampled_from(["Tesla", ""]), st.just("0")),
                max_size=2))
def test_evaluate_raises_only_nvc_error(exprs, cuda, gpus):
    try:
        evaluate(exprs, cuda, "550.1", gpus)
    except NvcError:
        pass
