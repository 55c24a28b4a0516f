"""An exported model folder's names (``freescale.training.export.exported_model`` describes the folder), read
without torch: `freescale train --init-from` recognises a folder by them before any rank starts."""
from __future__ import annotations

FORMAT = "freescale.exported_model/1"
MODEL_FILE, WEIGHTS_FILE, ITEMS_FILE = "model.json", "weights.pt", "item_vocab.json"
USER_FEATURES_FILE, EVALUATION_FILE = "user_feature_vocab.json", "evaluation.json"
ITEM_TABLE = "item_table"
USER_TABLE = "user_tables.{index}"
