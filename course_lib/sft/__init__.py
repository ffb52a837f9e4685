"""The fine-tuning product a practitioner runs (course_lib/recipes/sft.py, chapter 10): chat data and its masks,
tokenizers, model directories, the loop's pieces, evaluation, checkpoints, the speed paths, the backends that
apply the parallelisms to one training loop, and chapter 11's grid of its variants. Everything here runs inside a
rank; it builds on the parallelisms and the memory model, never on the workbook."""
