"""Text models: tokenizer and text runners, and text requests' tokenizing and queueing."""
