"""The course's distributed recipes: real scripts, launched with torchrun or deepspeed (`cl.launch`), runnable
on a cluster as they are. Each one has a typed `Config` (course_lib.config) and a `main(argv=None)`, and does
nothing at import time, so a notebook imports it to build a config: `from course_lib.recipes import sft`.
See README.md beside this file.
"""
