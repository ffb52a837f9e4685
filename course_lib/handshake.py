"""What the notebook's launcher (`course_lib.launch`) and the ranks it starts (`course_lib.dist`) agree on.

A tiny module of its own, so that code running inside a rank never imports the notebook-side launcher.
Introduced in chapter 05.
"""
RESULT_TAG = "COURSE_RESULT "  # a rank prints this + JSON; `cl.launch` returns it as `run.result`
LAUNCH_ID_VAR = "COURSE_LAUNCH_ID"  # every process of one launch carries it: the sweep finds them all
PARENT_PID_VAR = "COURSE_PARENT_PID"  # the notebook kernel's pid: a rank exits when it dies
