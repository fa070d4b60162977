"""ext/embedded"""
