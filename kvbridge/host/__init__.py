"""What kvbridge needs from the host it runs on: checked local files (:mod:`.files`)."""
