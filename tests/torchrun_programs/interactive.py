"""Rank 0 talks to whoever runs it, as a program under torchrun may: ``interactive.py pdb`` stops at a
``breakpoint()`` (pdb reads its commands from stdin; ``x`` is 6 there), ``interactive.py ask`` asks a name with
``input()`` and greets it. Every rank then prints ``rank <RANK> done``.
"""

import os
import sys

x = 6
if os.environ["RANK"] == "0":
    if sys.argv[1] == "pdb":
        breakpoint()
    else:
        print("hello", input("name? "))
print("rank", os.environ["RANK"], "done")
