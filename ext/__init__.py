"""Worker-side engine: torch ops (ops.py), slot table (slots.py), workers. Import is light:
nothing here loads torch or the compiled extension until a submodule is imported."""
