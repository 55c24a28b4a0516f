"""`freescale pipeline`, the scheduled pipeline in one place: its stages (`run`), its typed TOML
(`config`), and the engine that skips a stage whose fingerprint is current (`stages`).
"""
