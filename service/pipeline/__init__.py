"""The request core every protocol front shares: one error vocabulary (more to come)."""
