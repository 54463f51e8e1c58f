"""The language-model families a project builds on: what every LM shares (``base``), decoder-only (``decoder``)
and encoder-decoder (``seq2seq``) models; a project keeps only its architecture."""
