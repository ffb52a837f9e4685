"""The parallelisms, one file per technique (picotron's layout), and what they share: mixed precision (chapter
01), data parallelism by hand and DDP (05), ZeRO with DeepSpeed (06), FSDP2 (07), tensor and pipeline
parallelism (08); the process group and what a rank reports (`dist`), and what the collectives send (`comm`).
Everything here runs inside a rank; it reads the memory model and its instruments, never the SFT product or the
workbook."""
