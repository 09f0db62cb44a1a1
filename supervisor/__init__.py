"""The launcher: one isolated process per GPU, prefixed logs, kill-all, hang watchdog, failure report.

Never imports torch at module level: it must start fast.
"""
