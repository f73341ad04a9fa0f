"""How sites whose compute nodes cannot dial out reach their parameter server: the relay run beside them."""
