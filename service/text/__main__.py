"""`python -m service.text`: print the packaged all-MiniLM-L6-v2 directory (see tokenizer.main)."""

from service.text.tokenizer import main

main()
