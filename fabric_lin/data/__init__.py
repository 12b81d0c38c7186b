"""Tokenizer, prepared-data checks and the data modules."""
from fabric_lin.data.base import DataModule
from fabric_lin.data.long_documents import LongDocuments
from fabric_lin.data.prepared import check_prepared_dir
from fabric_lin.data.sample_corpus import SampleCorpus
from fabric_lin.data.slimpajama_starcoder import SlimPajamaStarcoder
from fabric_lin.data.text_files import TextFiles
from fabric_lin.data.token_chunks import TokenChunks
from fabric_lin.data.tokenizer import Tokenizer

__all__ = ["DataModule", "SlimPajamaStarcoder", "TextFiles", "TokenChunks", "SampleCorpus", "LongDocuments", "Tokenizer", "check_prepared_dir"]
