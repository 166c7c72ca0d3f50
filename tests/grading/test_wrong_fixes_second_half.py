"""The second half of the labs' wrong-fix catalogues (see test_wrong_fixes.py)."""

from __future__ import annotations

import pytest
from test_wrong_fixes import CATALOGUED, check_catalogue


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("lab", CATALOGUED[len(CATALOGUED) // 2:])
def test_every_wrong_fix_stays_below_its_bound(lab, tmp_path):
    check_catalogue(lab, tmp_path)
