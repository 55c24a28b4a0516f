"""`freescale pipeline`, the scheduled pipeline in one place: its run (`run`), its stages, one record
each (`table`), its typed TOML (`config`), and the engine that skips a stage whose fingerprint is current (`stages`).
"""
