"""What a call did on one rank, as text a multi-rank test can compare across ranks (tests/ is on sys.path)."""


def outcome_of(fn) -> str:
    """'value' when ``fn()`` returned (or its result, when that is a string), else 'ExcType: message' followed
    by the exception's notes."""
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - the test inspects the type and text
        return f"{type(e).__name__}: {e} " + " ".join(getattr(e, "__notes__", []))
    return result if isinstance(result, str) else "value"
