"""The second half of the labs' wrong-fix catalogues (see test_wrong_fixes.py)."""

from __future__ import annotations

import pytest
from test_wrong_fixes import CATALOGUED, cases, check_wrong_fix


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("lab", "name"), cases(CATALOGUED[len(CATALOGUED) // 2:]))
def test_a_wrong_fix_stays_below_its_bound(lab, name, tmp_path):
    check_wrong_fix(lab, name, tmp_path)
