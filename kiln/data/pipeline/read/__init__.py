"""Reading inputs: file formats and WARC, offset indexes of compressed files, HTML text extraction."""
