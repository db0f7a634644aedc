"""Runtime patches to pinned upstream versions, installed as ``openrlhf_populora.patches``.

One sub-package per upstream release (``openrlhf_0_11_2``). Each refuses to apply to any other version and
records a source hash of every upstream function it replaces or relies on (``upstream.lock.json``), so an
upstream change is caught by a test instead of by a silent misbehaviour at run time.
"""
