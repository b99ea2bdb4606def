"""Files hf-spec writes and reads back: output folders written whole or not at all (`output_folder`), checksum
lists (`integrity`) and JSON-lines files (`jsonl`)."""
