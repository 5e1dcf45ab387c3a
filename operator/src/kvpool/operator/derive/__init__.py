"""Decisions the operator derives from a spec, shared by render, validation and status.

Why: render (which objects and files to emit) and validation (which specs to refuse) must
agree on every derived fact: platform defaults, each instance's engine and TP size, its ports,
the LMCache settings kvpool owns, the engine command line, sizes and in-cluster addresses.
Computing them once here, purely, means validation never reaches into render and a key the
renderer starts emitting is owned (refused as an override) without anyone listing it.
"""
