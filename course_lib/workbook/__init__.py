"""The workbook's machinery, which runs in a notebook's kernel, never in a rank: the ledger, exercises, widgets,
launching recipes from a cell, running the chapters headless, the report and the book, JupyterLab, the benchmark
against HF Trainer, and the Keras side of chapter 02."""
