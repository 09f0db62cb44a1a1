"""What the operator reads about a run.

* `summary` — the end of a run: what each rank did, why the run ended, the exit code;
* `footer` — the live footer (terminal mode only): one row per rank under the scrolling lines.

Imports the rooms below it; `footer` loads rich only in terminal mode.
"""
